"""Reading a PostgreSQL vault out: items for export and search, and `verify`.

Functions over a `PgVault` (vault.engines.postgres.vault), so that the file vault's commands run on
a URL with the same meaning:

- `opened_items`: one session's rows, read in one snapshot, decrypted one at a
  time as the caller iterates (vault.export and vault.search stream them as
  they stream a file's). During an online rotation each row is opened with the
  key its envelope names.
- `verify`: the file's `verify` without what PostgreSQL makes meaningless
  (SQLite's integrity check, the scrub): every item authenticated in batches
  from a server-side cursor, the guard trigger and the body of its function
  compared with what memvault creates, the migrations, the meta. A rotation in
  progress is reported as such, not as a problem. Read-only: one read-only
  REPEATABLE READ transaction, no migration.

`memvault backup` of a URL is vault.engines.postgres.backup.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault import crypto
from vault.engines.postgres import rotate as pgrotate
from vault.engines.postgres import schema as pgschema
from vault.engines.postgres.base import PgVaultBase as PgVault
from vault.engines.postgres.url import parse
from vault.engines.sqlite.schema import MESSAGES_TABLE, SESSIONS_TABLE
from vault.errors import (
    VaultBusy,
    VaultError,
)
from vault.vaultops import check_limit, open_rows, parse_ttl
from vault.verify import _KID, BATCH, PROBLEMS, VerifyReport, check_meta, check_migrations

if TYPE_CHECKING:
    from vault.keys import KeyStore

NOT_APPLICABLE = "not applicable: PostgreSQL"
# Said wherever a file vault's verify would vouch for the order of the history.
NOT_CHAINED = (
    "not built on PostgreSQL yet: items reordered, replayed, deleted or rolled back "
    "by a writer of the tables are not detected; see SECURITY.md"
)
PG_TABLES = (
    SESSIONS_TABLE,
    MESSAGES_TABLE,
    "memvault_meta",
    "memvault_audit",
    "memvault_backups",
    "memvault_keys",
    "memvault_migrations",
)
GUARD = "memvault_guard"
# pg_trigger.tgtype of BEFORE INSERT OR UPDATE ... FOR EACH ROW: ROW 1 | BEFORE 2 |
# INSERT 4 | UPDATE 16.
GUARD_TGTYPE = 1 | 2 | 4 | 16


# --------------------------------------------------------------------------
# Items, for export and search
# --------------------------------------------------------------------------
def opened_items(
    vault: PgVault,
    session_id: str,
    limit: int | None = None,
    now: int | None = None,
    include_expired: bool = False,
) -> Iterator[crypto.Opened]:
    """Every stored row of the session, oldest first, as `Vault.opened_items` gives them.

    The rows (ciphertext) are read in one snapshot before this returns, UnknownSession
    and the key errors included; each is decrypted only when the iterator reaches it.
    """
    check_limit(limit)
    vault.sealer()
    for _attempt in range(50):

        async def read(conn: Any) -> tuple[dict[str, str], list[str]]:
            meta = await vault.read_meta(conn)
            await vault.require_session(conn, session_id)
            # The agent session's own order (created_at, then id), newest `limit` rows.
            rows = await conn.fetch(
                f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = $1 "
                "ORDER BY created_at DESC, id DESC LIMIT $2",
                session_id,
                limit,
            )
            return meta, [r[0] for r in rows][::-1]

        meta, rows = vault.run(read)
        keys = vault.keys_for(meta["kid"], meta.get(pgrotate.FROM))
        if keys is None:
            continue  # the key moved on between the key load and the snapshot
        ttl = parse_ttl(meta, vault.path)
        default = keys[meta["kid"]]

        def pick(
            data: str, keys: dict[str, crypto.Sealer] = keys, default: crypto.Sealer = default
        ) -> crypto.Sealer:
            return keys.get(pgrotate.kid_of(data) or "", default)  # the key its envelope names

        return open_rows(pick, session_id, rows, ttl, now, include_expired)
    raise VaultBusy(f"{vault.path} kept changing key while being read; try again")


# --------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------
PG_PROBLEMS = {
    **PROBLEMS,
    "guard_triggers": (
        "guard trigger or its function missing, altered, disabled or unexpected",
        "the vault's schema was changed outside memvault: find out who changed it, and "
        "restore the schema from a backup (pg_dump) or a `memvault backup` copy",
    ),
    "meta": (
        "meta rows missing or invalid",
        "the vault's settings were changed outside memvault: restore them from a backup",
    ),
}


@dataclass
class PgVerifyReport(VerifyReport):
    """`verify` of a PostgreSQL vault: no integrity check or scrub (not applicable)."""

    CHECKED = "guard trigger and its function, meta, schema"
    CHECKED_NOTE = (
        " (integrity check and scrub: not applicable: PostgreSQL; not checked: the history"
        f" chain, {NOT_CHAINED})"
    )
    problem_texts = PG_PROBLEMS
    rotation: dict[str, Any] | None = None
    schema: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        out["backend"] = "postgresql"
        out["schema"] = self.schema
        out["rotation"] = self.rotation
        out["not_applicable"] = {"integrity": NOT_APPLICABLE, "scrub_pending": NOT_APPLICABLE}
        out["not_checked"] = {"history_chain": NOT_CHAINED}
        return out


def verify(url: str, keystore: KeyStore | None = None) -> PgVerifyReport:
    """Check the vault at `url` without changing it; NotAVault (exit 3) when there is none."""
    # Not PgVault.open: that would migrate, and verify reports instead of fixing.
    vault = PgVault(parse(url), keystore)

    async def exists(conn: Any) -> None:
        if await conn.fetchval("SELECT to_regclass('memvault_meta')") is None:
            await vault.refuse_unusable_schema(conn)
            raise vault.no_vault(await pgschema.current_schema(conn))

    vault.run(exists)
    for _attempt in range(50):
        report = PgVerifyReport(vault.path)
        keys = _keys(vault, report)

        async def check(
            conn: Any,
            keys: dict[str, crypto.Sealer] | None = keys,
            report: PgVerifyReport = report,
        ) -> bool:
            meta = {r[0]: r[1] for r in await conn.fetch("SELECT key, value FROM memvault_meta")}
            if keys is not None and (
                meta.get("kid") not in keys or meta.get(pgrotate.FROM, meta.get("kid")) not in keys
            ):
                return False  # rotated since the keys were loaded: load them again
            report.schema = await pgschema.current_schema(conn)
            check_meta(meta, report)
            if pgrotate.FROM in meta:
                if not _KID.fullmatch(meta[pgrotate.FROM]):
                    shown = meta[pgrotate.FROM][:40]
                    report.add("meta", f"{pgrotate.FROM} {shown!r} is not a key id")
                report.rotation = {
                    "from_kid": meta[pgrotate.FROM],
                    "done_through_id": meta.get(pgrotate.PROGRESS, "0"),
                }
            if await _schema(conn, report):
                await _guard(conn, report, report.schema or "")
                await _items(conn, report, keys, meta)
            return True

        if vault.run(check):
            return report
    raise VaultBusy(f"{vault.path} kept changing key while being verified; try again")


def _keys(vault: PgVault, report: VerifyReport) -> dict[str, crypto.Sealer] | None:
    """The sealers of every kid in use (the current one; the old one while a rotation runs)."""

    def load() -> dict[str, crypto.Sealer]:
        current = vault.sealer(refresh=True)
        keys = {current.kid: current}
        old_kid = vault.meta().get(pgrotate.FROM)
        if old_kid is not None:
            old = vault.sealer_for_kid(old_kid)
            if old is not None:
                keys[old_kid] = old
        return keys

    return report.load_keys(load)


async def _schema(conn: Any, report: VerifyReport) -> bool:
    """Tables and migrations; whether the items' table is there to read."""
    present = {t for t in PG_TABLES if await conn.fetchval("SELECT to_regclass($1)", t)}
    for table in PG_TABLES:
        if table not in present:
            report.add("schema", f"table {table} is missing")
    if "memvault_migrations" in present:
        done = {r[0] for r in await conn.fetch("SELECT name FROM memvault_migrations")}
        check_migrations(done, [name for name, _ in pgschema.MIGRATIONS], report)
    if MESSAGES_TABLE not in present:
        report.unverified_reason = report.unverified_reason or "the items' table is missing"
        return False
    return True


def expected_guard_body(schema: str) -> str:
    """The guard function's body as memvault creates it (what pg_proc.prosrc holds)."""
    return pgschema.guard_function(schema).split("$guard$")[1]


async def _guard(conn: Any, report: VerifyReport, schema: str) -> None:
    """The trigger on the items' table and its function, as pgschema creates them."""
    fn = await conn.fetchrow(
        "SELECT p.prosrc, l.lanname, p.prorettype::regtype::text AS returns, p.pronargs "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "JOIN pg_language l ON l.oid = p.prolang WHERE n.nspname = $1 AND p.proname = $2",
        schema,
        GUARD,
    )
    if fn is None:
        report.add("guard_triggers", f"function {GUARD}() is missing")
    elif (fn["prosrc"], fn["lanname"], fn["returns"], fn["pronargs"]) != (
        expected_guard_body(schema),
        "plpgsql",
        "trigger",
        0,
    ):
        report.add("guard_triggers", f"function {GUARD}() differs from the one memvault creates")
    triggers = await conn.fetch(
        "SELECT t.tgname, c.relname, t.tgenabled::text AS tgenabled, t.tgtype, "
        "t.tgattr::text AS attrs, "
        "t.tgqual IS NOT NULL AS has_when, pn.nspname AS fn_schema, p.proname AS fn_name, "
        "(SELECT attnum FROM pg_attribute WHERE attrelid = c.oid "
        " AND attname = 'message_data')::text AS data_col "
        "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "JOIN pg_proc p ON p.oid = t.tgfoid JOIN pg_namespace pn ON pn.oid = p.pronamespace "
        "WHERE n.nspname = $1 AND NOT t.tgisinternal AND c.relname = ANY($2::text[]) "
        "ORDER BY t.tgname",
        schema,
        list(PG_TABLES),
    )
    found = False
    for t in triggers:
        if t["tgname"] != GUARD or t["relname"] != MESSAGES_TABLE:
            report.add(
                "guard_triggers", f"unexpected trigger {t['tgname'][:60]!r} on {t['relname']}"
            )
            continue
        found = True
        if t["tgenabled"] == "D":
            report.add("guard_triggers", f"trigger {GUARD} is disabled")
        elif (t["tgenabled"], t["tgtype"], t["attrs"], t["has_when"]) != (
            "O",
            GUARD_TGTYPE,
            t["data_col"],
            False,
        ) or (t["fn_schema"], t["fn_name"]) != (schema, GUARD):
            report.add("guard_triggers", f"trigger {GUARD} differs from the one memvault creates")
    if not found:
        report.add("guard_triggers", f"trigger {GUARD} on {MESSAGES_TABLE} is missing")


async def _items(
    conn: Any,
    report: VerifyReport,
    keys: dict[str, crypto.Sealer] | None,
    meta: dict[str, str],
) -> None:
    """Count (and with the keys, authenticate) every item, BATCH rows at a time."""
    try:
        ttl = parse_ttl(meta, Path(report.path))
    except VaultError:
        ttl = None  # reported with the meta; items are still authenticated
    report.sessions = int(
        await conn.fetchval(
            f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
            f"SELECT session_id FROM {MESSAGES_TABLE}) s"
        )
    )
    current = None if keys is None else keys.get(meta.get("kid", ""))
    authenticated = 0
    cursor = await conn.cursor(
        f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} ORDER BY id"
    )
    while batch := await cursor.fetch(BATCH):
        report.items += len(batch)
        if keys is None or current is None:
            continue
        for row_id, sid, data in batch:
            sealer = keys.get(pgrotate.kid_of(data) or "", current)
            state = sealer.state(str(sid), data, ttl, decode=True)  # as verify.py: decoded too
            if state is crypto.ItemState.UNREADABLE:
                report.add("unauthenticated_items", f"item {row_id} of session {str(sid)[:60]!r}")
                continue
            authenticated += 1
            report.expired += state is crypto.ItemState.EXPIRED
    if keys is not None and current is not None:
        report.authenticated = authenticated
