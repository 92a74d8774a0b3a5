"""`memvault import`: encrypt a plaintext `SQLiteSession` file into the vault.

The source is any SQLite file written by the SDK's `SQLiteSession`, with its
default table names (`agent_sessions` / `agent_messages`) or custom ones. The
tables are recognised by their shape (the SDK's exact columns, the messages
table's foreign key to the sessions table) or named with `sessions_table` /
`messages_table`.

Guarantees:

* Every item is sealed with the vault's current key (`crypto.Sealer.seal`) and
  a session's rows go in with ONE transaction: a session is imported whole or
  not at all. Inside that transaction the rows are read back, decrypted and
  compared (count and content digest, in order) with the source before COMMIT.
* Nothing is imported when a session id is already in the vault, or when the
  source is not a plaintext SQLiteSession file (not SQLite, no tables of the
  SDK's shape, a memvault vault, EncryptedSession envelopes, rows that are not
  JSON): each refusal names the reason.
* Item order is kept (source `id` order), and so are the rows' `created_at`
  columns. The Fernet timestamps, which the TTL reads, are the time of the
  import: the TTL of imported items counts from the import.
* `shred_source=True` takes an exclusive lock on the source first (refusing,
  exit 5, while another process has it open), so nothing can be added to it
  between the read and the destruction, which `vault.source_shred` does, and a
  rerun of a killed run finishes.

This module never imports `agents`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from vault import backupmark, chainops, crypto, files, paths, source_shred, targets, testhooks
from vault.engines.sqlite import chainrows
from vault.engines.sqlite.db import audit
from vault.engines.sqlite.schema import (
    MESSAGES_TABLE,
    SESSIONS_TABLE,
    SQLITE_MAGIC,
    session_exists_sql,
    utcnow,
)
from vault.errors import BadInput, OperationFailed, UnknownSession
from vault.files import Progress
from vault.import_source import (
    INTERNAL_TABLES,
    NotUTF8,
    Plan,
    ReadBack,
    SourceSession,
    decode_row,
    digest_update,
    find_pair,
    is_text,
    list_tables,
    open_source,
    quote_name,
)

if TYPE_CHECKING:
    from vault.engine import AnyVault
    from vault.engines.sqlite.lifecycle import KeyLifecycle

BATCH = 500


@dataclass(frozen=True)
class Part:
    """One source session to import: its place among them, and the progress bar."""

    session: SourceSession
    number: int
    of: int
    progress: Progress | None


class Importer:
    """Open, inspect and check a source; then `run()` imports it (and shreds it).

    Use as a context manager: the source connection (and, with `shred_source`,
    its exclusive lock) is held from `open` to the end, so the rows read are
    the rows destroyed.
    """

    def __init__(
        self,
        vault: AnyVault,
        source: str | Path,
        session_id: str | None = None,
        sessions_table: str | None = None,
        messages_table: str | None = None,
        shred_source: bool = False,
    ) -> None:
        backupmark.refuse_writes(vault, "`memvault import`")
        self.vault = vault
        self.source = Path(os.path.realpath(Path(source).expanduser()))  # SQLite follows links too
        self.session_id = session_id
        self.shred_source = shred_source
        self._conn: sqlite3.Connection | None = None
        self.resume = source_shred.Interrupted.of(vault, self.source, shred_source)
        self.already: list[SourceSession] = []
        if self.resume.done and source_shred.looks_destroyed(self.source):
            self.plan = Plan(self.source, "", "", [], [], True)
            return  # only the interrupted shred is left to finish
        self._check_file()
        self._conn = open_source(self.source, self.shred_source)
        try:
            self.plan = self._inspect(sessions_table, messages_table)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Importer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    @property
    def conn(self) -> sqlite3.Connection:
        assert self._conn is not None, "the importer is closed"
        return self._conn

    # -- inspection -----------------------------------------------------
    def _check_file(self) -> None:
        src = self.source
        paths.require_text_path(src, "the source path")
        targets.refuse_vault_file(src, targets.vault_path_of(self.vault), targets.NOT_A_SOURCE)
        if not src.exists():
            raise BadInput(f"no file at {src}; give the path of a plaintext SQLiteSession file")
        if src.is_dir():
            raise BadInput(f"{src} is a folder; give the path of a SQLiteSession database file")
        kind = files.special(src)
        if kind:  # a FIFO would block the read below for ever
            raise BadInput(f"{src} is a {kind}; give the path of a SQLiteSession database file")
        odd = files.odd_entries(paths.sidecars(src)[1:])
        if odd:
            p, what = odd[0]
            raise OperationFailed(
                f"{p} is a {what}, not a file SQLite made; SQLite would write through it; "
                "move it away (for a link, `rm` removes only the name) and retry; "
                "nothing was imported"
            )
        try:
            with open(src, "rb") as fh:
                header = fh.read(len(SQLITE_MAGIC))
        except OSError as exc:
            raise OperationFailed(
                f"cannot read {src} ({exc.strerror}); check its permissions"
            ) from None
        if header != SQLITE_MAGIC:
            raise OperationFailed(
                f"{src} is not a SQLite database, so it is not a SQLiteSession file; "
                "nothing was imported"
            )

    def _inspect(self, sessions_table: str | None, messages_table: str | None) -> Plan:
        src = self.source
        tables = list_tables(self.conn)
        if "memvault_meta" in tables:
            raise OperationFailed(
                f"{src} is a memvault vault, not a plaintext SQLiteSession file; "
                "nothing was imported"
            )
        s_tab, m_tab = find_pair(self.conn, src, tables, sessions_table, messages_table)
        try:
            counts = dict(
                self.conn.execute(
                    f"SELECT session_id, count(*) FROM {quote_name(m_tab)} GROUP BY session_id"
                ).fetchall()
            )
            listed = self.conn.execute(
                f"SELECT session_id, created_at, updated_at FROM {quote_name(s_tab)} "
                "ORDER BY session_id"
            ).fetchall()
        except NotUTF8:
            raise OperationFailed(
                f"a session id (or timestamp) in {src} is not valid UTF-8 text, which "
                "SQLiteSession never writes; repair or delete that session; nothing was imported"
            ) from None
        sessions: dict[str, SourceSession] = {}
        for sid, created, updated in listed:
            if isinstance(sid, str) and not is_text(sid):
                raise OperationFailed(
                    f"a session id in {src} holds a lone surrogate, which is not valid "
                    "Unicode text; repair or delete that session; nothing was imported"
                )
            sessions[sid] = SourceSession(str(sid), int(counts.get(sid, 0)), created, updated)
        for sid, n in counts.items():  # rows whose session row is missing (no FK enforcement)
            sessions.setdefault(sid, SourceSession(str(sid), int(n)))
        chosen = sorted(sessions.values(), key=lambda s: s.session_id)
        if self.session_id is not None:
            chosen = [s for s in chosen if s.session_id == self.session_id]
            if not chosen and self.resume.recorded(self.session_id) is None:
                have = ", ".join(sorted(sessions)) or "none"
                raise UnknownSession(
                    f"no session {self.session_id!r} in {src} (its sessions: {have}); "
                    "nothing was imported"
                )
        other_tables = [t for t in tables if t not in (s_tab, m_tab, *INTERNAL_TABLES)]
        plan = Plan(src, s_tab, m_tab, chosen, other_tables, self.shred_source)
        self._check_contents(plan)
        self.already = [
            s for s in chosen if self.resume.already_in(self.vault, s, self._items(plan, s))
        ]
        plan.sessions = [s for s in chosen if s not in self.already]
        self._check_vault(plan)
        if self.shred_source:
            source_shred.check_shreddable(
                plan, set(sessions) - {s.session_id for s in self.already}, self.session_id
            )
        return plan

    def _check_contents(self, plan: Plan) -> None:
        """Every row to import is UTF-8 JSON and plaintext (not an EncryptedSession envelope)."""
        for s in plan.sessions:
            try:
                found = self.conn.execute(
                    f"SELECT id, message_data FROM {quote_name(plan.messages_table)} "
                    "WHERE session_id = ? ORDER BY id",
                    (s.session_id,),
                ).fetchall()
            except NotUTF8:
                raise OperationFailed(
                    f"an item of session {s.session_id!r} in {plan.source} is not valid UTF-8 "
                    "text, which SQLiteSession never writes; repair or delete that row; "
                    "nothing was imported"
                ) from None
            for row_id, data in found:
                item = self._decode(plan, s.session_id, row_id, data)
                if isinstance(item, dict) and item.get("__enc__") == 1:
                    raise OperationFailed(
                        f"session {s.session_id!r} of {plan.source} holds encrypted envelopes "
                        "(an EncryptedSession file), not plaintext items; import reads only "
                        "plaintext SQLiteSession files; nothing was imported"
                    )

    def _items(self, plan: Plan, s: SourceSession) -> Iterator[Any]:
        for row_id, data, _created in self._source_rows(s, plan):
            yield self._decode(plan, s.session_id, row_id, data)

    def _decode(self, plan: Plan, session_id: str, row_id: int, data: Any) -> Any:
        label = f"row {row_id} of session {session_id!r} in {plan.source} ({plan.messages_table})"
        return decode_row(label, data)

    def _check_vault(self, plan: Plan) -> None:
        present = set(self.vault.session_ids())
        clash = [s.session_id for s in plan.sessions if s.session_id in present]
        if clash:
            shown = ", ".join(repr(c) for c in clash[:5]) + (" …" if len(clash) > 5 else "")
            raise OperationFailed(
                f"session {shown} already exists in the vault {self.vault.path}; an import never "
                "merges into an existing session; import the others one by one with --session, "
                "or `memvault clear` the vault's copy first; nothing was imported"
            )

    # -- the import -----------------------------------------------------
    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        """Import every planned session (one transaction each), then shred if asked."""
        plan = self.plan
        vault = self.vault
        sealer = vault.sealer()
        imported: list[dict[str, Any]] = []
        for part, s in enumerate(plan.sessions, 1):
            n = self._import_session(Part(s, part, len(plan.sessions), progress), sealer)
            imported.append({"session_id": s.session_id, "items": n})
            sealer = vault.sealer()
            testhooks.failpoint("import-session-committed")
        report: dict[str, Any] = {
            "source": str(plan.source),
            "tables": {"sessions": plan.sessions_table, "messages": plan.messages_table},
            "sessions": imported,
            "items": sum(i["items"] for i in imported),
            "kid": sealer.kid,
            "source_shredded": None,
            # Imported by a killed run of this same command: not imported twice.
            "already_imported": [
                {"session_id": s.session_id, "items": s.items} for s in self.already
            ],
        }
        if self.shred_source:
            report["source_shredded"] = source_shred.shred(self._conn, plan, self.close)
            self._record(
                source_shred.SOURCE_EVENT,
                vault.sealer().kid,
                source=self.resume.mark,
                files=len(report["source_shredded"]["files"]),
                bytes=sum(f["size"] for f in report["source_shredded"]["files"]),
                rows=report["source_shredded"]["rows"],
            )
        report["at"] = utcnow()
        return report

    def _record(self, event: str, kid: str, **details: Any) -> None:
        """An audit event in the vault (a PostgreSQL vault's importer writes its own)."""
        self.vault.record(event, kid, **details)

    def _source_rows(self, s: SourceSession, plan: Plan | None = None) -> sqlite3.Cursor:
        table = (plan or self.plan).messages_table
        return self.conn.execute(
            f"SELECT id, message_data, created_at FROM {quote_name(table)} "
            "WHERE session_id = ? ORDER BY id",
            (s.session_id,),
        )

    # -- what both engines' imports do with each session ------------------
    def _appeared(self, sid: str, part: int) -> OperationFailed:
        return OperationFailed(
            f"session {sid!r} appeared in the vault during the import; it was not "
            f"imported ({part - 1} session(s) before it were)"
        )

    def _seal_batch(
        self,
        sid: str,
        batch: list[Any],
        sealer: crypto.Sealer,
        digest: Any,
        when: Callable[[Any], Any] = lambda created: created,
    ) -> list[tuple[str, str, Any]]:
        """A batch of source rows decoded, digested in order and sealed: (sid, envelope,
        `when(created_at)`) for the engine to insert."""
        sealed = []
        for row_id, data, created in batch:
            item = self._decode(self.plan, sid, row_id, data)
            digest_update(digest, item)
            sealed.append((sid, sealer.seal(sid, item), when(created)))
        return sealed

    def _audited(self, sid: str, count: int, part: int, parts: int) -> dict[str, Any]:
        """The details of a session's `import` audit event (the marks a rerun resumes by)."""
        return {"items": count, "part": part, "parts": parts, **self.resume.marks(sid)}

    def _inserted(self, n: int, progress: Progress | None) -> int:
        """A batch of `n` rows is in (not committed yet): the progress bar moves on."""
        if progress:
            progress(n)
        testhooks.failpoint("import-in-transaction")
        return n

    def _read_back(self, sid: str, sealer: crypto.Sealer) -> ReadBack:
        return ReadBack(sid, sealer)

    def _import_session(self, p: Part, sealer: crypto.Sealer) -> int:
        """One session into a vault file, in one transaction (PgImporter's is PostgreSQL's)."""
        s, part, parts, progress = p.session, p.number, p.of, p.progress
        vault = cast("KeyLifecycle", self.vault)
        sid = s.session_id
        source_digest = hashlib.sha256()
        count = 0
        with vault.write_transaction() as conn:
            sealer = vault.check_writable(conn, sealer, sid)
            if conn.execute(session_exists_sql("?"), (sid, sid)).fetchone():
                raise self._appeared(sid, part)
            conn.execute(
                f"INSERT INTO {SESSIONS_TABLE} (session_id, created_at, updated_at) "
                "VALUES (?, coalesce(?, CURRENT_TIMESTAMP), coalesce(?, CURRENT_TIMESTAMP))",
                (sid, s.created_at, s.updated_at),
            )
            rows = self._source_rows(s)
            key, at = chainops.key_of(sealer, vault.vault_id), None
            while batch := rows.fetchmany(BATCH):
                sealed = self._seal_batch(sid, batch, sealer, source_digest)
                texts = [s[1] for s in sealed]
                head = chainrows.read_head(conn, sid)  # the last batch's
                links, at = chainrows.append(conn, key, sid, texts, str(vault.path), head)
                conn.executemany(  # each row with its chain link, the head moved with them
                    f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, created_at, chain) "
                    "VALUES (?, ?, coalesce(?, CURRENT_TIMESTAMP), ?)",
                    [(*s, lk) for s, lk in zip(sealed, links, strict=True)],
                )
                count += self._inserted(len(batch), progress)
            check = self._read_back(sid, sealer)
            for (data,) in conn.execute(
                f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = ? ORDER BY id",
                (sid,),
            ):
                if not check.add(data):
                    break
            check.done(s, count, source_digest, part)
            audit(conn, "import", sealer.kid, **self._audited(sid, count, part, parts))
        vault.wrote(at)  # a state this object knows, as one it read
        return count
