"""The vault file's format: its tables, guard triggers and migrations.

The file keeps the SDK's own `agent_sessions` / `agent_messages` tables
unchanged (so `SQLiteSession` can still open it) and adds `memvault_meta`,
`memvault_audit`, `memvault_keys`, `memvault_migrations`, the history chain's tables,
two guard triggers and an index for counting. Migrations are a list of functions,
each applied once and recorded by name.
"""

from __future__ import annotations

import datetime as _dt
import sqlite3
from collections.abc import Callable

# A file's format: every session's history chained (m010); older releases refuse it.
FILE_FORMAT = "memvault/4"
# memvault/3: a PostgreSQL vault's format (vault.engines.postgres), and a file's before m010.
FORMAT = "memvault/3"
# 0.2's files: moved to FORMAT by m009 on their first open (0.2 then refuses them: its
# start-up tidy would destroy the key versions kept for backups).
PREVIOUS_FORMAT = "memvault/2"
# 0.1.0's files: the same tables, but the key in the keyring under the bare vault id.
# Such a file moves to FILE_FORMAT on its first open with the key (engines.sqlite.legacy).
LEGACY_FORMAT = "memvault/1"
DEFAULT_TTL = 30 * 86400
SESSIONS_TABLE = "agent_sessions"
MESSAGES_TABLE = "agent_messages"


# The audit trail's and the key journal's columns, the same in both engines' tables (the
# PostgreSQL ones add their own id column: vault.engines.postgres.schema).
AUDIT_COLUMNS = """at TEXT NOT NULL,
               event TEXT NOT NULL,
               kid TEXT,
               details TEXT NOT NULL DEFAULT '{}'"""
KEY_COLUMNS = """kid TEXT PRIMARY KEY,
               state TEXT NOT NULL
                   CHECK (state IN ('pending', 'current', 'retired', 'destroyed')),
               created_at TEXT NOT NULL,
               changed_at TEXT NOT NULL"""


def session_exists_sql(p: str) -> str:
    """A row if the session is in the vault (its own row, or items without one); `p` is
    the engine's placeholder for its id, bound to each of the two (`?`, or `$1` once)."""
    return (
        f"SELECT 1 FROM {SESSIONS_TABLE} WHERE session_id = {p} UNION ALL "
        f"SELECT 1 FROM {MESSAGES_TABLE} WHERE session_id = {p} LIMIT 1"
    )


SQLITE_MAGIC = b"SQLite format 3\x00"
# A shred in progress stamps the file so that a second run recognises and finishes it.
SHRED_MAGIC = b"memvault-shred\x00\x00"


def utcnow() -> str:
    """The one timestamp format of the file (meta, audit, migrations): UTC, to the second."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# Whether the audit trail records a rotation; the same SQL on both engines.
ROTATION_LOGGED = "SELECT 1 FROM memvault_audit WHERE event = 'rotate' LIMIT 1"


def last_rotation(meta: dict[str, str], rotation_logged: bool) -> str | None:
    """The time of the last rotation, or None if the vault was never rotated.

    `init` writes `rotated_at` equal to `created_at`; a rotation in that same second
    is told apart by its audit event.
    """
    at = meta.get("rotated_at")
    if at is not None and at == meta.get("created_at") and not rotation_logged:
        return None
    return at


# Migrations: applied in this order, each recorded once by name.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = []


def migration(fn: Callable[[sqlite3.Connection], None]) -> Callable[[sqlite3.Connection], None]:
    MIGRATIONS.append(fn)
    return fn


@migration
def m001_sdk_tables(conn: sqlite3.Connection) -> None:
    # The exact DDL of the SDK's SQLiteSession, so the SDK recognises the file.
    conn.execute(
        f"""CREATE TABLE IF NOT EXISTS {SESSIONS_TABLE} (
                session_id TEXT PRIMARY KEY,
                created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
                updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
            )"""
    )
    conn.execute(
        f"""CREATE TABLE IF NOT EXISTS {MESSAGES_TABLE} (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                session_id TEXT NOT NULL,
                message_data TEXT NOT NULL,
                created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
                FOREIGN KEY (session_id) REFERENCES {SESSIONS_TABLE} (session_id)
                    ON DELETE CASCADE
            )"""
    )
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS idx_{MESSAGES_TABLE}_session_id "
        f"ON {MESSAGES_TABLE} (session_id, id)"
    )


@migration
def m002_meta(conn: sqlite3.Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS memvault_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
    )


# A row may enter agent_messages only as a well-formed envelope under the current kid:
# this refuses plaintext from a bare SQLiteSession, items under another key, and a
# writer that opened the vault before a rotation. m003's clause, kept as it was: m008
# replaces it in every file (a migration is history, and verify rebuilds m003's triggers
# for a file that has not applied m008 yet).
_NOT_SEALED_V1 = """
    CASE WHEN json_valid(NEW.message_data) THEN
        json_type(NEW.message_data) IS NOT 'object'
        OR json_extract(NEW.message_data, '$.__enc__') IS NOT 1
        OR json_type(NEW.message_data, '$.payload') IS NOT 'text'
        OR json_extract(NEW.message_data, '$.payload') NOT GLOB 'gAAAAA*'
        OR json_extract(NEW.message_data, '$.kid') IS NOT
            (SELECT value FROM memvault_meta WHERE key = 'kid')
        OR (SELECT count(*) FROM json_each(NEW.message_data)) != 4
    ELSE 1 END
"""
GUARD_MESSAGE = "memvault: refused an item not sealed with the vault's current key"


@migration
def m003_guard_triggers(conn: sqlite3.Connection) -> None:
    conn.execute(
        f"""CREATE TRIGGER IF NOT EXISTS memvault_guard_insert
            BEFORE INSERT ON {MESSAGES_TABLE} WHEN {_NOT_SEALED_V1}
            BEGIN SELECT RAISE(ABORT, '{GUARD_MESSAGE.replace("'", "''")}'); END"""
    )
    conn.execute(
        f"""CREATE TRIGGER IF NOT EXISTS memvault_guard_update
            BEFORE UPDATE OF message_data ON {MESSAGES_TABLE} WHEN {_NOT_SEALED_V1}
            BEGIN SELECT RAISE(ABORT, '{GUARD_MESSAGE.replace("'", "''")}'); END"""
    )


@migration
def m004_audit(conn: sqlite3.Connection) -> None:
    # Events and counts only: never content, never a session's items.
    conn.execute(
        f"""CREATE TABLE IF NOT EXISTS memvault_audit (
               id INTEGER PRIMARY KEY AUTOINCREMENT,
               {AUDIT_COLUMNS}
           )"""
    )


@migration
def m005_key_versions(conn: sqlite3.Connection) -> None:
    # The journal of every key version the file used or staged (vault.keyjournal).
    conn.execute(
        f"""CREATE TABLE IF NOT EXISTS memvault_keys (
               {KEY_COLUMNS}
           )"""
    )


# An item's Fernet timestamp, read in SQL from its envelope without authenticating it:
# for `status` and `sessions` to count expired items from an index instead of reading
# (and authenticating) every row. A token starts with "gAAAAA" (the version byte and
# the timestamp's zero top bytes) and its characters 7-12 are the timestamp's low 36
# bits (until the year 4147), 6 bits each; every function here is built in and
# deterministic, so any connection (the bare SDK's too) maintains the index. NULL for
# a row with no such token. Unverified: `memvault verify` authenticates every item.
_B64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_TOKEN_AT = "instr(message_data, '\"gAAAAA')"
ITEM_TIME = (
    f"(CASE WHEN {_TOKEN_AT} > 0 THEN "
    + " + ".join(
        f"((instr('{_B64_ALPHABET}', substr(message_data, {_TOKEN_AT} + {i}, 1)) - 1)"
        f" << {6 * (12 - i)})"
        for i in range(7, 13)
    )
    + " END)"
)
ITEM_TIME_INDEX = "memvault_item_time"


@migration
def m006_item_time_index(conn: sqlite3.Connection) -> None:
    # Counting per session and by time reads this index alone (a few bytes an item),
    # never the rows: `status` on a million items stays well under a second.
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS {ITEM_TIME_INDEX} "
        f"ON {MESSAGES_TABLE} (session_id, {ITEM_TIME})"
    )


# The token's timestamp to the window of 4,096 s that holds it: its characters 7-10
# (bits 35-12), left in base64. Two string functions a row, where ITEM_TIME takes
# nineteen: the index is rebuilt for every row a rotation rewrites, and m006's index
# of ITEM_TIME cost a rotation a fifth of its time. `status` counts whole windows from
# this index and reads only the rows of the one window that holds the cut-off.
ITEM_WINDOW = f"(CASE WHEN {_TOKEN_AT} > 0 THEN substr(message_data, {_TOKEN_AT} + 7, 4) END)"
ITEM_WINDOW_INDEX = "memvault_item_window"
WINDOW_SECONDS = 1 << 12


def window_start(chars: str | None) -> int | None:
    """The first second of the window ITEM_WINDOW's characters name (None: no token)."""
    if chars is None or len(chars) != 4:
        return None
    value = 0
    for ch in chars:
        digit = _B64_ALPHABET.find(ch)
        if digit < 0:
            return None
        value = value << 6 | digit
    return value * WINDOW_SECONDS


@migration
def m007_item_window_index(conn: sqlite3.Connection) -> None:
    conn.execute(f"DROP INDEX IF EXISTS {ITEM_TIME_INDEX}")
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS {ITEM_WINDOW_INDEX} "
        f"ON {MESSAGES_TABLE} (session_id, {ITEM_WINDOW})"
    )


# m008's clause. m003's costs a rotation, which rewrites every row, two full JSON parses
# a row: json_valid's (SQLite caches it for the json_type and json_extract calls after
# it) and json_each's, which parses again. A row in exactly the layout the sealers write
# (crypto.seal and the SDK's EncryptedSession, both json.dumps with default separators)
#     {"__enc__": 1, "v": 1, "kid": "<current kid>", "payload": "gAAAAA..."}
# is recognised from json_valid's parse alone: the row must equal that text rebuilt
# from its own decoded payload. A payload with a quote, a backslash or a NUL in it
# decodes to other text than the row holds there, so nothing can follow it: the row is
# that one envelope and nothing else, not even a NUL and more after it (the comparison
# takes the whole value). The meta's kid, put in as it is, must hold no quote or
# backslash either. No other pass over the row's text: each one costs about a parse.
#
# Any other row meets the full check, json_each's pass over the top level: exactly four
# members, each of the envelope's keys exactly once (`key` is the label as JSON readers
# decode it; an array's keys are integers and a scalar's is NULL, so neither matches),
# with its JSON type:
#   __enc__  the integer 1 (not 1.0 or true, which m003's json_extract took for 1)
#   v        an integer (m003 let any fourth member through: plaintext under "content")
#   kid      the meta's current kid, a JSON string
#   payload  a JSON string that starts like a Fernet token
# A label given twice is refused: m003's json_extract read the first and json.loads
# keeps the last, so {"payload": "gAAAAA...", "p\u0061yload": "plaintext"} got in. So is
# a NUL anywhere: SQLite's JSON parser stops at the first one, and m003 let in an
# envelope followed by a NUL and anything at all. json_valid stays the first test, so
# that malformed JSON gets the guard's message, not json_each's "malformed JSON".
_SEALED_HEAD = '{"__enc__": 1, "v": 1, "kid": "'
_SEALED_MID = '", "payload": "'
_SEALED_TAIL = '"}'
_AS_SEALED = f"""(
            SELECT NEW.message_data =
                    '{_SEALED_HEAD}' || m.value || '{_SEALED_MID}'
                    || json_extract(NEW.message_data, '$.payload') || '{_SEALED_TAIL}'
                AND substr(NEW.message_data, 1, {len(_SEALED_HEAD + _SEALED_MID) + 6}
                    + length(m.value))
                    = '{_SEALED_HEAD}' || m.value || '{_SEALED_MID}gAAAAA'
            FROM memvault_meta AS m
            WHERE m.key = 'kid' AND instr(m.value, '"') = 0 AND instr(m.value, '\\') = 0
        )"""
_NOT_SEALED = f"""
    CASE
        WHEN json_valid(NEW.message_data) IS NOT 1 THEN 1
        WHEN {_AS_SEALED} THEN 0
        WHEN instr(NEW.message_data, char(0)) THEN 1
        ELSE (
            SELECT count(*) != 4
                OR total(key = '__enc__' AND type = 'integer' AND atom = 1) != 1
                OR total(key = 'v' AND type = 'integer') != 1
                OR total(key = 'kid' AND type = 'text' AND atom =
                    (SELECT m.value FROM memvault_meta AS m WHERE m.key = 'kid')) != 1
                OR total(key = 'payload' AND type = 'text' AND atom GLOB 'gAAAAA*') != 1
            FROM json_each(NEW.message_data)
        )
    END
"""


def _guard(conn: sqlite3.Connection, refused: str) -> None:
    """The two guard triggers, replaced by ones that refuse a row when `refused` holds."""
    for name, event in (
        ("memvault_guard_insert", "INSERT"),
        ("memvault_guard_update", "UPDATE OF message_data"),
    ):
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
        conn.execute(
            f"""CREATE TRIGGER {name}
            BEFORE {event} ON {MESSAGES_TABLE} WHEN {refused}
            BEGIN SELECT RAISE(ABORT, '{GUARD_MESSAGE.replace("'", "''")}'); END"""
        )


@migration
def m008_guard_triggers_text_first(conn: sqlite3.Connection) -> None:
    _guard(conn, _NOT_SEALED)


# The journal's states from m009 on: `retained` is a retired version whose entry is kept,
# decrypt-only, because a backup recorded in `memvault_backups` needs it.
KEY_STATES_SQL = "'pending', 'current', 'retired', 'retained', 'destroyed'"
# Every backup made of this vault: where it was written (an absolute path), the key it
# uses, and the random id also written into the backup's own meta, which tells a
# backup that was replaced from one that is still there.
BACKUP_COLUMNS = """backup_id TEXT PRIMARY KEY,
               path TEXT NOT NULL,
               kid TEXT NOT NULL,
               created_at TEXT NOT NULL"""
BACKUPS_TABLE_SQL = f"""CREATE TABLE IF NOT EXISTS memvault_backups (
               {BACKUP_COLUMNS}
           )"""


@migration
def m009_retained_keys_and_backups(conn: sqlite3.Connection) -> None:
    # SQLite cannot change a CHECK constraint: the journal is copied into a new table
    # (rowids kept: they are its order).
    conn.execute(
        f"""CREATE TABLE memvault_keys_new (
               kid TEXT PRIMARY KEY,
               state TEXT NOT NULL CHECK (state IN ({KEY_STATES_SQL})),
               created_at TEXT NOT NULL,
               changed_at TEXT NOT NULL
           )"""
    )
    conn.execute(
        "INSERT INTO memvault_keys_new (rowid, kid, state, created_at, changed_at) "
        "SELECT rowid, kid, state, created_at, changed_at FROM memvault_keys"
    )
    conn.execute("DROP TABLE memvault_keys")
    conn.execute("ALTER TABLE memvault_keys_new RENAME TO memvault_keys")
    conn.execute(BACKUPS_TABLE_SQL)
    # A 0.1.0 file keeps its format: vault.engines.sqlite.legacy moves it (its keys first).
    conn.execute(
        "UPDATE memvault_meta SET value = ? WHERE key = 'format' AND value = ?",
        (FORMAT, PREVIOUS_FORMAT),
    )


@migration
def m010_history_chain(conn: sqlite3.Connection) -> None:
    # Links and vault head need the key: "building" until the first open with it links
    # the rows and sums them (chainrows.build), or the creation. Each step is idempotent.
    if "chain" not in {c[1] for c in conn.execute(f"PRAGMA table_info({MESSAGES_TABLE})")}:
        conn.execute(f"ALTER TABLE {MESSAGES_TABLE} ADD COLUMN chain TEXT")
    heads = "memvault_chain_heads (session_id TEXT PRIMARY KEY, head TEXT NOT NULL)"
    conn.execute(f"CREATE TABLE IF NOT EXISTS {heads}")
    one = "memvault_vault_head (id INTEGER PRIMARY KEY CHECK (id = 1), head TEXT NOT NULL)"
    conn.execute(f"CREATE TABLE IF NOT EXISTS {one}")  # the vault head: one row
    conn.execute("INSERT OR IGNORE INTO memvault_meta (key, value) VALUES ('chain', 'building')")
    # A row with no link is refused first: triggers cannot compute a MAC, so this stops
    # accidents (a bare SQLiteSession); the links' MACs stop an attacker.
    _guard(conn, f"CASE WHEN NEW.chain IS NULL THEN 1 ELSE {_NOT_SEALED.strip()} END")
    # A 0.1.0 file keeps its format: vault.engines.sqlite.legacy moves it (its keys first).
    conn.execute(
        "UPDATE memvault_meta SET value = ? WHERE key = 'format' AND value = ?",
        (FILE_FORMAT, FORMAT),
    )


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply the migrations not yet recorded; the caller holds a write transaction."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS memvault_migrations "
        "(name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
    )
    done = {r[0] for r in conn.execute("SELECT name FROM memvault_migrations")}
    applied = []
    for fn in MIGRATIONS:
        if fn.__name__ not in done:
            fn(conn)
            conn.execute(
                "INSERT INTO memvault_migrations (name, applied_at) VALUES (?, ?)",
                (fn.__name__, utcnow()),
            )
            applied.append(fn.__name__)
    return applied


def needs_migration(conn: sqlite3.Connection) -> bool:
    """Whether `migrate` has work to do (read-only: no write lock is taken to find out)."""
    try:
        done = {r[0] for r in conn.execute("SELECT name FROM memvault_migrations")}
    except sqlite3.OperationalError:
        return True
    return any(fn.__name__ not in done for fn in MIGRATIONS)
