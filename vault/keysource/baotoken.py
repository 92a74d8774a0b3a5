"""Where a transit source finds its server and its credentials (no client library here).

The address: `VAULT_ADDR` or `BAO_ADDR`. The credentials, first found wins:
1. a token in `VAULT_TOKEN` or `BAO_TOKEN`;
2. a token file: `MEMVAULT_TRANSIT_TOKEN_FILE` if set, else `~/.vault-token` if there;
3. AppRole: a role id (`MEMVAULT_TRANSIT_ROLE_ID` or the file named by
   `MEMVAULT_TRANSIT_ROLE_ID_FILE`) and a secret id (`MEMVAULT_TRANSIT_SECRET_ID` or
   `MEMVAULT_TRANSIT_SECRET_ID_FILE`), at the auth mount `MEMVAULT_TRANSIT_APPROLE_MOUNT`
   (default `approle`).
memvault never writes a token. A file holding a secret should be 0600: one that other
users may open is used, with a one-line warning.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from vault.errors import BadInput, KeySourceDenied, KeySourceUnavailable

ENV_ADDRS = ("VAULT_ADDR", "BAO_ADDR")
ENV_TOKENS = ("VAULT_TOKEN", "BAO_TOKEN")
ENV_TOKEN_FILE = "MEMVAULT_TRANSIT_TOKEN_FILE"
ENV_ROLE_ID = "MEMVAULT_TRANSIT_ROLE_ID"
ENV_SECRET_ID = "MEMVAULT_TRANSIT_SECRET_ID"
ENV_APPROLE_MOUNT = "MEMVAULT_TRANSIT_APPROLE_MOUNT"
DEFAULT_TOKEN_FILE = "~/.vault-token"
MAX_SECRET_FILE = 64 * 1024

Warn = Callable[[str], None]


def warn_on_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _either(names: tuple[str, ...]) -> tuple[str, str] | None:
    """(variable, value) of the first of `names` that is set; two that differ are refused
    rather than guessed between. The values are never in the message (tokens)."""
    found = [(n, os.environ[n].strip()) for n in names if os.environ.get(n, "").strip()]
    if len({value for _, value in found}) > 1:
        raise BadInput(
            f"{' and '.join(n for n, _ in found)} are both set and differ; unset the one "
            "that is not meant for memvault"
        )
    return found[0] if found else None


def address() -> str:
    """The server's URL, checked for shape (never contacted here)."""
    found = _either(ENV_ADDRS)
    if found is None:
        raise KeySourceUnavailable(
            "no key service address: set VAULT_ADDR or BAO_ADDR to the OpenBao or Vault "
            "server's URL, e.g. https://bao.example.com:8200"
        )
    var, value = found
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(
            f"{var}={value!r} is not an http(s) URL of a server; set it to e.g. "
            "https://bao.example.com:8200"
        )
    return value.rstrip("/")


@dataclass(frozen=True)
class Credentials:
    """A token, or AppRole's role id and secret id to log in with; `origin` says where
    they came from, for messages (never the secret itself)."""

    origin: str
    token: str | None = field(default=None, repr=False)
    role_id: str | None = field(default=None, repr=False)
    secret_id: str | None = field(default=None, repr=False)
    approle_mount: str = "approle"


def read_secret_file(path: Path, what: str, warn: Warn) -> str:
    """One secret from a file: whitespace stripped, never empty; a warning (one line)
    when other users may open the file."""
    try:
        with open(path, "rb") as handle:
            st = os.fstat(handle.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise BadInput(f"{what} {path} is not a regular file; give the file holding it")
            data = handle.read(MAX_SECRET_FILE + 1)
    except FileNotFoundError:
        raise BadInput(f"{what} {path} does not exist; give the file that holds it") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise BadInput(f"cannot read {what} {path} ({reason}); check its permissions") from None
    if os.name == "posix" and st.st_mode & 0o077:
        warn(
            f"warning: {what} {path} may be opened by other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}"
        )
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = ""
    if not text or len(data) > MAX_SECRET_FILE or any(c.isspace() for c in text):
        raise BadInput(f"{what} {path} does not hold one token or id on one line; fix the file")
    return text


def _from_env_or_file(var: str, what: str, warn: Warn) -> str | None:
    value = os.environ.get(var, "").strip()
    if value:
        return value
    path = os.environ.get(var + "_FILE", "").strip()
    if path:
        return read_secret_file(Path(path).expanduser(), what, warn)
    return None


def credentials(warn: Warn = warn_on_stderr) -> Credentials:
    found = _either(ENV_TOKENS)
    if found is not None:
        return Credentials(origin=found[0], token=found[1])
    named = os.environ.get(ENV_TOKEN_FILE, "").strip()
    path = Path(named or DEFAULT_TOKEN_FILE).expanduser()
    if named or path.exists():
        token = read_secret_file(path, "the token file", warn)
        return Credentials(origin=f"the token file {path}", token=token)
    role_id = _from_env_or_file(ENV_ROLE_ID, "the AppRole role id file", warn)
    secret_id = _from_env_or_file(ENV_SECRET_ID, "the AppRole secret id file", warn)
    if role_id and secret_id:
        mount = os.environ.get(ENV_APPROLE_MOUNT, "").strip().strip("/") or "approle"
        return Credentials(
            origin=f"AppRole login at auth/{mount}",
            role_id=role_id,
            secret_id=secret_id,
            approle_mount=mount,
        )
    if role_id or secret_id:
        missing = ENV_SECRET_ID if role_id else ENV_ROLE_ID
        raise KeySourceDenied(
            f"AppRole needs both a role id and a secret id, and {missing} (or "
            f"{missing}_FILE) is not set; set it"
        )
    raise KeySourceDenied(
        "no token for the key service: set VAULT_TOKEN or BAO_TOKEN, put one in "
        f"{DEFAULT_TOKEN_FILE} (mode 0600) or name its file with {ENV_TOKEN_FILE}, or give "
        f"AppRole credentials with {ENV_ROLE_ID} and {ENV_SECRET_ID} (or their _FILE forms)"
    )
