"""PostgreSQL vault locations: reading a URL, and never showing its password.

`--db`, `$MEMVAULT_DB` and `db_path` take a path or a URL
`postgresql+asyncpg://user:password@host:port/dbname[?schema=NAME]`.
`vault.paths.postgres_url` tells the two apart (every command asks); this module
is loaded once a URL is named. Every message that names a PostgreSQL vault shows
`redact_url`'s form of it.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field

from vault.errors import BadInput

DRIVER = "postgresql+asyncpg"
# postgres:// and postgresql:// are what other tools print; memvault always talks asyncpg.
_URL = re.compile(r"^(postgres|postgresql)(\+[A-Za-z0-9_]+)?://", re.IGNORECASE)
# Every `key=value` of a query; a key is compared once percent-decoded, as the driver reads it
# (`pass%77ord=` is `password=` to it).
_QUERY_PARAM = re.compile(r"([?&])([^=&#]*)=([^&#]*)")
_SECRET_KEYS = frozenset({"password", "passfile", "sslpassword"})
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
INSTALL_HINT = (
    "PostgreSQL support needs `pip install 'memvault[postgres]'` "
    "(from a clone of the source: `pip install -e '.[postgres]'`)"
)
# The commands (and library calls) a PostgreSQL vault supports so far.
SUPPORTED = (
    "init, status, sessions, show, clear, pop, ttl, log, purge, rotate, revoke, shred, "
    "export, search, verify, backup, import, chat, key list/export/import, and "
    "vault.open_session"
)


def unsupported(url: str) -> str:
    """The one line for a command that cannot use a PostgreSQL vault yet (exit 2)."""
    return (
        f"{redact_url(url)} is a PostgreSQL vault, which this command does not support yet "
        f"(supported: {SUPPORTED}); nothing was changed"
    )


def redact_url(url: str) -> str:
    """The URL with its password (in the user part or the query) replaced by `***`.

    Works on malformed URLs too (no parsing that could fail). A password typed
    without percent-encoding may hold `/`, `?`, `#` or `@`, so the user part runs to
    the last `@` of the whole URL: when in doubt this hides too much, never too little.
    """
    head, sep, rest = url.partition("://")
    if sep:
        at = rest.rfind("@")
        if at >= 0:
            userinfo = rest[:at]
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":***"
            url = f"{head}://{userinfo}@{rest[at + 1 :]}"
    return _QUERY_PARAM.sub(_hide_secret_param, url)


def _hide_secret_param(m: re.Match[str]) -> str:
    key = urllib.parse.unquote_plus(m.group(2)).strip().lower()
    return f"{m.group(1)}{m.group(2)}=***" if key in _SECRET_KEYS else m.group(0)


def _bad_port(hosts: str, ports: str | None) -> bool:
    """Whether a port in `host:port[,host:port]` (or `?port=`) is not a number 1-65535, or
    an IPv6 address lacks its `]`: the driver would fail on it with a bare ValueError."""
    found = [] if ports is None else ports.split(",")
    for spec in hosts.split(",") if hosts else []:
        if spec.startswith("["):
            close = spec.find("]")
            if close < 0 or (spec[close + 1 :] and not spec[close + 1 :].startswith(":")):
                return True
            spec = spec[close + 1 :]
        if ":" in spec:
            found.append(spec.rpartition(":")[2])
    return any(not (p.isascii() and p.isdigit() and 1 <= int(p) <= 65535) for p in found)


@dataclass(frozen=True)
class PgLocation:
    """A parsed PostgreSQL vault location; its repr shows the redacted URL only."""

    # Never in a repr (a debugger, a log line): these hold the password.
    url: str = field(repr=False)  # as given: only ever handed to the driver
    dsn: str = field(repr=False)  # for asyncpg, without memvault's own `schema` parameter
    sqlalchemy_url: str = field(repr=False)  # for the SDK's SQLAlchemySession
    schema: str | None  # `?schema=NAME`, else None (the server's default, usually public)

    def __repr__(self) -> str:
        return f"PgLocation({self.display!r})"

    @property
    def display(self) -> str:
        """How every message names this vault: the password is never shown."""
        return redact_url(self.url)

    def server_settings(self) -> dict[str, str]:
        """Per-connection settings: the vault's schema first, timestamps in UTC."""
        out = {"timezone": "UTC"}
        if self.schema:
            # Quoted: unquoted, the server folds `Alice` to `alice`, and init then found
            # no schema to create the vault in (it had created "Alice").
            out["search_path"] = '"' + self.schema + '"'
        return out


def parse(url: str) -> PgLocation:
    """Read a PostgreSQL vault URL; BadInput (exit 2) for one memvault cannot use."""
    shown = redact_url(url)
    m = _URL.match(url)
    if not m:
        raise BadInput(f"{shown} is not a PostgreSQL URL; write postgresql+asyncpg://...")
    driver = (m.group(2) or "").lower()
    if driver not in ("", "+asyncpg"):
        raise BadInput(
            f"{shown}: memvault talks to PostgreSQL through asyncpg only; write the URL as "
            "postgresql+asyncpg://user:password@host:port/dbname; nothing was changed"
        )
    rest = url[m.end() :]
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    if rest.rfind("@") > authority_end:
        # An unencoded '/', '?' or '#' in the password would split it into the host,
        # the database or the query, and a message could then show a piece of it.
        raise BadInput(
            f"{shown}: an '@' comes after a '/', '?' or '#'; percent-encode those characters "
            "in the user name and password (/ is %2F, ? is %3F, # is %23, @ is %40); "
            "nothing was changed"
        )
    if rest[:authority_end].count("@") > 1:
        # The driver splits at the first '@': the rest of the password would be taken for
        # the host name, looked up in DNS and shown in errors as the server.
        raise BadInput(
            f"{shown}: the user name or password holds an unencoded '@'; percent-encode it "
            "as %40 (and / as %2F, ? as %3F, # as %23); nothing was changed"
        )
    base, _, query = rest.partition("?")
    query, _, _fragment = query.partition("#")
    params = urllib.parse.parse_qsl(query, keep_blank_values=True)
    schemas = [v for k, v in params if k == "schema"]
    others = [(k, v) for k, v in params if k != "schema"]
    schema = schemas[-1] if schemas else None
    if schema is not None and not _SCHEMA_NAME.match(schema):
        raise BadInput(
            f"{shown}: the schema name {schema[:70]!r} is not a plain SQL name (letters, "
            "digits and _, not starting with a digit, at most 63); nothing was changed"
        )
    hosts = base.split("@")[-1].split("/")[0]
    if not hosts and "host" not in dict(others):
        raise BadInput(
            f"{shown} names no server; write postgresql+asyncpg://user:password@host:port/"
            "dbname; nothing was changed"
        )
    if _bad_port(hosts, dict(others).get("port")):
        raise BadInput(
            f"{shown}: the port must be a number from 1 to 65535 (an IPv6 host goes in "
            "brackets: [::1]:5432); write postgresql+asyncpg://user:password@host:port/dbname; "
            "nothing was changed"
        )
    tail = ("?" + urllib.parse.urlencode(others)) if others else ""
    return PgLocation(
        url=url,
        dsn=f"postgresql://{base}{tail}",
        sqlalchemy_url=f"{DRIVER}://{base}{tail}",
        schema=schema,
    )
