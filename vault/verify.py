"""`verify`: check everything a vault promises, without changing it.

SQLite's `integrity_check`, every item authenticated under the key (in
batches, never all rows at once), the guard triggers as memvault creates them,
the meta rows and the recorded migrations, and the key itself. Unlike every other command it
neither migrates nor scrubs the file: it reports what it finds.

A key that cannot be used (missing, revoked, mismatched, no keyring) is a key
problem, exit 4 as everywhere else: the items could not be authenticated, so
the vault was not verified. The checks that need no key still run and are
reported.
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from vault import crypto, paths
from vault.engines.sqlite.db import (
    check_header,
    is_damage,
    keep_temp_in_memory,
    meta_rows,
    parse_ttl,
    refuse_odd_side_files,
)
from vault.engines.sqlite.lifecycle import KeyLifecycle
from vault.engines.sqlite.schema import (
    FILE_FORMAT,
    FORMAT,
    MESSAGES_TABLE,
    MIGRATIONS,
    SESSIONS_TABLE,
    migrate,
)
from vault.errors import KeyProblem, KeyRevoked, NotAVault, VaultBusy, VaultError
from vault.keys import KeyStore

if TYPE_CHECKING:
    from vault.chainfloor import Floor

T = TypeVar("T")

BATCH = 500
# Detail lines kept per problem: the counts are exact, the examples are a sample.
MAX_DETAILS = 20
REQUIRED_META = ("format", "vault_id", "kid", "ttl_seconds", "created_at", "rotated_at")
REQUIRED_TABLES = (SESSIONS_TABLE, MESSAGES_TABLE, "memvault_meta", "memvault_audit")
_VAULT_ID = re.compile(r"mv-[0-9a-f]{24}")
_KID = re.compile(re.escape(crypto.KID_PREFIX) + r"[0-9a-f]{16}")
_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")

# Each problem: what it means and what to do, for the human listing.
PROBLEMS: dict[str, tuple[str, str]] = {
    "integrity": (
        "SQLite integrity check errors",
        "the file is damaged: restore it from a backup (`memvault backup` makes one); "
        "`sqlite3 FILE .recover` may salvage rows",
    ),
    "unauthenticated_items": (
        "items that do not authenticate (tampered, corrupt or under another key)",
        "`memvault show SESSION` reports them per session; restore the vault from a backup, "
        "or delete them on purpose with `memvault clear SESSION --include-unreadable`",
    ),
    "history_chain": (
        "sessions whose history does not verify (reordered, replayed, cut or forged)",
        "the file was changed outside memvault: restore it from a backup; `memvault show "
        "SESSION --include-tampered` reads what is there, marked",
    ),
    "guard_triggers": (
        "guard triggers missing, altered or unexpected",
        "the file was changed outside memvault: restore it from a backup, and find out who "
        "changed it",
    ),
    "meta": (
        "meta rows missing or invalid",
        "the vault's settings were changed outside memvault: restore the vault from a backup "
        "(an invalid TTL alone is fixed by `memvault ttl 30d`)",
    ),
    "schema": (
        "tables or migrations missing or unknown",
        "missing migrations: any memvault command (`memvault status`) applies them; unknown "
        "ones: upgrade memvault; missing tables: restore the vault from a backup",
    ),
    "scrub_pending": (
        "unfinished scrub (replaced ciphertext may remain in the file)",
        "run any memvault command (`memvault status`) to finish it once no other process "
        "holds a read transaction",
    ),
}


@dataclass
class VerifyReport:
    """What `verify` found. `ok` only when every check ran and found nothing."""

    path: str
    vault_id: str | None = None
    kid: str | None = None
    items: int = 0
    sessions: int = 0
    authenticated: int | None = None  # None: the items could not be checked (no key)
    expired: int = 0
    problems: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROBLEMS, 0))
    details: dict[str, list[str]] = field(default_factory=dict)
    key: str = "not checked"
    key_error: KeyProblem | None = None
    unverified_reason: str | None = None  # why `authenticated` is None
    # What the human listing says was checked, and each problem's text (a PostgreSQL
    # vault's report, vault.engines.postgres.read, says its own).
    CHECKED: ClassVar[str] = "integrity, guard triggers, meta, schema"
    CHECKED_NOTE: ClassVar[str] = ""
    problem_texts: ClassVar[dict[str, tuple[str, str]]] = PROBLEMS

    @property
    def ok(self) -> bool:
        return (
            self.key_error is None
            and self.authenticated is not None
            and not any(self.problems.values())
        )

    def add(self, problem: str, detail: str, count: int = 1) -> None:
        self.problems[problem] += count
        shown = self.details.setdefault(problem, [])
        if len(shown) < MAX_DETAILS:
            shown.append(detail)

    def load_keys(self, load: Callable[[], T]) -> T | None:
        """`load()` (the vault's key or keys), or None with the reason recorded: no usable
        key (revoked, missing, damaged), or meta that names none."""
        try:
            keys = load()
        except KeyProblem as exc:
            self.key = "key revoked" if isinstance(exc, KeyRevoked) else "unusable"
            self.key_error = exc
            self.unverified_reason = "no usable key"
            return None
        except NotAVault:
            # Meta without vault id or kid: the meta check reports it; no key to look up.
            self.unverified_reason = "the meta does not name the vault's key"
            return None
        self.key = "present and matching"
        return keys

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "path": self.path,
            "vault_id": self.vault_id,
            "kid": self.kid,
            "items": self.items,
            "sessions": self.sessions,
            "authenticated": self.authenticated,
            "expired": self.expired,
            "problems": dict(self.problems),
            "details": {k: list(v) for k, v in self.details.items()},
            "fixes": {k: self.problem_texts[k][1] for k, n in self.problems.items() if n},
            "key": self.key,
            "key_problem": self.key_error.message if self.key_error else None,
            "unverified_reason": self.unverified_reason,
        }


def verify(
    db: str | os.PathLike[str] | None = None, keystore: KeyStore | None = None
) -> VerifyReport:
    """Check the vault at `db` (resolved as everywhere). Raises only when there is no
    vault to check (NotAVault, exit 3), or for an unreadable or busy file."""
    path = paths.resolve_db_path(db)
    check_header(path)  # exit 3 for nothing or not SQLite; a truncated file is VaultCorrupt
    refuse_odd_side_files(path)
    # Not Vault.open: that would migrate and scrub, and verify reports instead of fixing.
    vault = KeyLifecycle(path, keystore)
    for _attempt in range(50):
        report = VerifyReport(str(path))
        sealer = report.load_keys(lambda: vault.sealer(refresh=True))
        # The anchor before the snapshot: one recorded meanwhile is never newer than it.
        floor = None if sealer is None else _floor(vault, sealer)
        with vault.connection() as conn:
            conn.execute("BEGIN")  # one snapshot: meta, kid and rows agree
            meta = _meta(conn, report)
            if sealer is not None and meta.get("kid") != sealer.kid:
                continue  # rotated since the key was loaded: load it again
            _schema(conn, report)
            _triggers(conn, report)
            _integrity(conn, report)
            _items(conn, report, sealer, meta)
            # Not on a damaged file: its indexes may name rows that are not there.
            if sealer and report.authenticated is not None and not report.problems["integrity"]:
                from vault.engines.sqlite.chainreport import judge_chains

                judge_chains(conn, report, sealer, meta, floor)
        # The read transaction ended with the connection (rolled back). The anchor moves
        # outside the file, to a vault head only memvault can have written.
        vault.record_anchor()
        return report
    raise VaultBusy(
        f"{path} kept changing key while being verified (rotations in a loop?); try again"
    )


def _floor(vault: KeyLifecycle, sealer: crypto.Sealer) -> Floor | None:
    from vault.engines.sqlite.anchoring import backup_away, floor_for

    try:
        meta = vault.meta()
        away = backup_away(meta, vault.path)
        return floor_for(meta, sealer, vault.keystore, vault.path, away=away)
    except VaultError:
        return None  # the meta unreadable: reported by the checks that follow


def _meta(conn: sqlite3.Connection, report: VerifyReport) -> dict[str, str]:
    try:
        meta = meta_rows(conn)
    except sqlite3.OperationalError as exc:
        if is_damage(exc):
            raise
        raise NotAVault(
            f"{report.path} is a SQLite database but not a memvault vault (no memvault_meta "
            "table); nothing to verify"
        ) from None
    check_meta(meta, report, FILE_FORMAT)
    return meta


def check_meta(meta: dict[str, str], report: VerifyReport, fmt: str = FORMAT) -> None:
    """The meta rows: required keys, format (`fmt`: the engine's), vault id and key id
    formats, TTL, timestamps."""
    report.vault_id, report.kid = meta.get("vault_id"), meta.get("kid")
    for key in REQUIRED_META:
        if key not in meta:
            report.add("meta", f"{key} is missing")
    if "format" in meta and meta["format"] != fmt:
        report.add("meta", f"unknown format {meta['format'][:40]!r} (this memvault: {fmt})")
    if "vault_id" in meta and not _VAULT_ID.fullmatch(meta["vault_id"]):
        report.add("meta", f"vault_id {meta['vault_id'][:40]!r} is not a memvault vault id")
    revoked = "revoked_at" in meta
    kid_key = "revoked_kid" if revoked else "kid"
    if kid_key in meta and not _KID.fullmatch(meta[kid_key]):
        report.add("meta", f"{kid_key} {meta[kid_key][:40]!r} is not a memvault key id")
    if revoked:
        report.kid = meta.get("revoked_kid")
    if "ttl_seconds" in meta:
        try:
            parse_ttl(meta, Path(report.path))
        except VaultError:
            report.add("meta", f"ttl_seconds {meta['ttl_seconds'][:40]!r} is not a TTL")
    for key in ("created_at", "rotated_at"):
        if key in meta and not _STAMP.fullmatch(meta[key]):
            report.add("meta", f"{key} {meta[key][:40]!r} is not a UTC timestamp")
    if meta.get("scrub_pending") == "1" and not revoked:
        report.add("scrub_pending", "a rotation, purge or clear has not finished its scrub")
    if "shred_started" in meta:
        report.add("meta", "a shred was interrupted: run `memvault shred` again to finish it")


def _schema(conn: sqlite3.Connection, report: VerifyReport) -> None:
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table in REQUIRED_TABLES:
        if table not in tables:
            report.add("schema", f"table {table} is missing")
    if "memvault_migrations" not in tables:
        report.add("schema", "table memvault_migrations is missing (a vault before migrations?)")
        return
    done = {r[0] for r in conn.execute("SELECT name FROM memvault_migrations")}
    check_migrations(done, [fn.__name__ for fn in MIGRATIONS], report)


def check_migrations(done: set[str], known: list[str], report: VerifyReport) -> None:
    """Every migration this memvault knows is applied, and none it does not know (both
    engines' `verify`)."""
    for name in known:
        if name not in done:
            report.add("schema", f"migration {name} is not applied")
    for name in sorted(done - set(known)):
        report.add("schema", f"migration {name[:60]!r} is unknown (a newer memvault wrote it?)")


@functools.cache
def expected_triggers(applied: frozenset[str] | None = None) -> dict[str, str]:
    """The triggers memvault creates, as SQLite stores them: built in memory, never copied.

    `applied`: the migrations a file records (None: all). A file not yet migrated keeps
    the triggers of the migrations it has (m003's, before m008 replaced them), which
    are then memvault's own; the schema check reports the missing migrations."""
    mem = sqlite3.connect(":memory:", isolation_level=None)
    try:
        keep_temp_in_memory(mem)
        if applied is None:
            migrate(mem)
        else:
            for fn in MIGRATIONS:
                if fn.__name__ in applied:
                    fn(mem)
        return dict(mem.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
    except sqlite3.Error:
        # A recorded history no memvault wrote (a migration without the tables it builds
        # on): compare with the current triggers; the schema check says what is missing.
        return expected_triggers()
    finally:
        mem.close()


def _applied(conn: sqlite3.Connection) -> frozenset[str] | None:
    try:
        return frozenset(r[0] for r in conn.execute("SELECT name FROM memvault_migrations"))
    except sqlite3.OperationalError as exc:
        if is_damage(exc):
            raise
        return None  # no migrations table: reported by _schema


def _triggers(conn: sqlite3.Connection, report: VerifyReport) -> None:
    found = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
    expected = expected_triggers(_applied(conn))
    for name, sql in expected.items():
        if name not in found:
            report.add("guard_triggers", f"{name} is missing")
        elif found[name] != sql:
            report.add("guard_triggers", f"{name} differs from the one memvault creates")
    for name in sorted(set(found) - set(expected)):
        report.add("guard_triggers", f"unexpected trigger {name[:60]!r}")


def _integrity(conn: sqlite3.Connection, report: VerifyReport) -> None:
    try:
        lines = [r[0] for r in conn.execute("PRAGMA integrity_check")]
    except sqlite3.DatabaseError as exc:
        if not is_damage(exc):
            raise
        report.add("integrity", f"the check itself failed: {exc}")
        return
    if lines != ["ok"]:
        for line in lines:
            report.add("integrity", str(line))


def _items(
    conn: sqlite3.Connection,
    report: VerifyReport,
    sealer: crypto.Sealer | None,
    meta: dict[str, str],
) -> None:
    """Count (and with a key, authenticate) every item, BATCH rows at a time."""
    try:
        ttl = parse_ttl(meta, Path(report.path))
    except VaultError:
        ttl = None  # reported by _meta; items are still authenticated
    authenticated = 0
    try:
        report.sessions = conn.execute(
            f"SELECT count(*) FROM (SELECT session_id FROM {SESSIONS_TABLE} UNION "
            f"SELECT session_id FROM {MESSAGES_TABLE})"
        ).fetchone()[0]
        cur = conn.execute(f"SELECT id, session_id, message_data FROM {MESSAGES_TABLE} ORDER BY id")
        while batch := cur.fetchmany(BATCH):
            report.items += len(batch)
            if sealer is None:
                continue
            for row_id, sid, data in batch:
                text = data if isinstance(data, str) else ""
                # Decoded too: an item a read would skip must not pass as authenticated.
                state = sealer.state(str(sid), text, ttl, decode=True)
                if state is crypto.ItemState.UNREADABLE:
                    report.add(
                        "unauthenticated_items", f"item {row_id} of session {str(sid)[:60]!r}"
                    )
                    continue
                authenticated += 1
                if state is crypto.ItemState.EXPIRED:
                    report.expired += 1
    except sqlite3.DatabaseError as exc:
        if is_damage(exc):
            report.add("integrity", f"reading the items stopped after {report.items}: {exc}")
            report.unverified_reason = report.unverified_reason or "the file is damaged"
        elif isinstance(exc, sqlite3.OperationalError):  # no such table or column
            report.add("schema", f"the items cannot be read: {exc}")
            report.unverified_reason = report.unverified_reason or "the items cannot be read"
        else:
            raise
        return
    if sealer is not None:
        report.authenticated = authenticated
