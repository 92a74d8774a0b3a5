"""`memvault import` into a PostgreSQL vault: the file importer, writing to the server.

vault.importer reads, checks and (with --shred-source) destroys the plaintext
source; only the writing differs. Each session goes in with ONE transaction
that holds the vault's key id (vault.engines.postgres.base `change`: a rotation can neither
switch nor finish meanwhile), is read back, decrypted and compared with the
source before COMMIT, and is audited in it, as on a file.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from typing import TYPE_CHECKING, Any, cast

from vault import crypto
from vault.engines.postgres import schema as pgschema
from vault.engines.sqlite.schema import MESSAGES_TABLE, SESSIONS_TABLE, session_exists_sql
from vault.importer import BATCH, Importer, Part

if TYPE_CHECKING:
    from vault.engines.postgres.base import Keys
    from vault.engines.postgres.kept import PgKeptVersions as PgVault


def _when(value: Any) -> _dt.datetime | None:
    """A source row's `created_at` (SQLite's text) as a timestamp; None: the server's now."""
    if not isinstance(value, str):
        return None
    try:
        when = _dt.datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if when.tzinfo is not None:
        when = when.astimezone(_dt.UTC).replace(tzinfo=None)
    return when


class PgImporter(Importer):
    """`Importer` whose sessions go into a PostgreSQL vault."""

    @property
    def pg(self) -> PgVault:
        # The base class reads the vault through what both kinds offer (path,
        # session_ids, sealer, record); the writing is this class's own.
        return cast("PgVault", self.vault)

    def _import_session(self, p: Part, sealer: crypto.Sealer) -> int:
        s, part, parts, progress = p.session, p.number, p.of, p.progress
        sid = s.session_id
        rows = self._source_rows(s)

        async def body(conn: Any, keys: Keys, current: crypto.Sealer) -> int:
            if await conn.fetchval(
                session_exists_sql("$1"),
                sid,
            ):
                raise self._appeared(sid, part)
            await conn.execute(
                f"INSERT INTO {SESSIONS_TABLE} (session_id, created_at, updated_at) VALUES "
                "($1, coalesce($2::timestamp, localtimestamp), "
                "coalesce($3::timestamp, localtimestamp))",
                sid,
                _when(s.created_at),
                _when(s.updated_at),
            )
            source_digest = hashlib.sha256()
            count = 0
            # The server reads a session by (created_at, id): the times are kept, never
            # let to run backwards, so that order stays the source's id order.
            last: list[_dt.datetime | None] = [None]

            def when(created: Any) -> _dt.datetime | None:
                at = _when(created)
                if at is not None and last[0] is not None and at < last[0]:
                    at = last[0]
                last[0] = at or last[0]
                return at

            while batch := rows.fetchmany(BATCH):
                await conn.executemany(
                    f"INSERT INTO {MESSAGES_TABLE} (session_id, message_data, created_at) "
                    "VALUES ($1, $2, coalesce($3::timestamp, localtimestamp))",
                    self._seal_batch(sid, batch, current, source_digest, when),
                )
                count += self._inserted(len(batch), progress)
            check = self._read_back(sid, current)
            async for record in conn.cursor(
                f"SELECT message_data FROM {MESSAGES_TABLE} WHERE session_id = $1 "
                "ORDER BY created_at, id",
                sid,
            ):
                if not check.add(record[0]):
                    break
            check.done(s, count, source_digest, part)
            await pgschema.audit(
                conn, "import", current.kid, **self._audited(sid, count, part, parts)
            )
            return count

        return self.pg.change(body)
