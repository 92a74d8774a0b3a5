"""Writing the decrypted history out (`memvault export`), and the readable text of an item.

An export is plaintext by nature: it leaves the vault's protection. It goes
through the one private-file writer (`files.write_private`: a new 0600 file,
never through a link; with `force`, a new file renamed over the old one) or to
a stream the caller owns (stdout). It is streamed session by session and item
by item: only one session's ciphertext and one decrypted item are held at a
time. Expired items are left out unless asked for; items that do not
authenticate are counted, never guessed at and never written.

`item_text` is the one reading of an item as text: the Markdown export and
`vault.search` both use it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from vault import backupmark, chainops, exportdirs, files, targets
from vault.crypto import ItemState
from vault.engine import AnyVault
from vault.errors import BadInput, OperationFailed, UnknownSession, VaultError
from vault.exportdirs import MD_TITLE, TEMP_TAG
from vault.exportdirs import remove_stale_exports as remove_stale_exports  # re-exported
from vault.textsafe import escape_line, escape_text

FORMATS = ("jsonl", "md")
_CHUNK = 1 << 16  # bytes gathered before each write
_ARGS_SHOWN = 120  # characters of a tool call's arguments in the Markdown export
_OUTPUT_SHOWN = 300  # characters of a tool's output in the Markdown export
# How an earlier export starts, so that --force knows it may replace the file: the
# Markdown title, or a JSONL record as `_render` writes it (json.dumps keeps the keys'
# order). An export with no item is an empty file.
_JSONL_START = re.compile(
    r'\{"session_id": "(?:[^"\\]|\\.)*", "position": [0-9]+, "timestamp": (?:null|"[^"]*"), '
    r'"expired": (?:true|false), "item": '
)
FORCE_REPLACES = "an earlier memvault export (or an empty file)"


# --------------------------------------------------------------------------
# The text of an item
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class ItemText:
    """What a person reads in an item.

    `role`: user, assistant, system, developer, "tool call", "tool output",
    reasoning, or the item's own type. `text`: a message's content, a call's
    arguments, an output's text. `name`: the tool of a call.
    """

    role: str
    text: str
    name: str | None = None

    @property
    def searchable(self) -> str:
        """The text a search scans: a call reads `name(arguments)`."""
        return f"{self.name}({self.text})" if self.name is not None else self.text


def _compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _parts_text(content: Any) -> str:
    """A string, or the text of a list of content parts (text, refusal; others named)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else _compact(content)
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            text = part.get("text", part.get("refusal"))
            out.append(text if isinstance(text, str) else f"[{part.get('type', 'part')}]")
    return "\n".join(out)


def item_text(item: Any) -> ItemText:
    """The readable text of one history item (an SDK input/output item, as stored)."""
    if not isinstance(item, dict):
        return ItemText("item", _compact(item))
    kind = str(item.get("type") or "")
    if "role" in item and kind in ("", "message"):
        return ItemText(str(item["role"]), _parts_text(item.get("content")))
    if kind.endswith("_call_output") or kind.endswith("_output"):
        return ItemText("tool output", _parts_text(item.get("output")))
    if kind.endswith("_call"):
        for key in ("arguments", "input", "action", "queries", "code"):
            if key in item:
                args = _compact(item[key])
                break
        else:
            args = ""
        return ItemText("tool call", args, str(item.get("name") or kind.removesuffix("_call")))
    if kind == "reasoning":
        return ItemText("reasoning", _parts_text(item.get("summary")))
    return ItemText(kind or "item", _compact(item))


def abbreviate(text: str, limit: int) -> str:
    """One line of at most `limit` characters: whitespace runs folded, an ellipsis if cut."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def iso_time(timestamp: int | None) -> str | None:
    """A Fernet timestamp (seconds) in the file's format, `YYYY-MM-DDTHH:MM:SSZ`."""
    if timestamp is None:
        return None
    return _dt.datetime.fromtimestamp(timestamp, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------
# Which sessions
# --------------------------------------------------------------------------
# What export and search read: a vault in either engine (vault.engine.AnyVault).
ItemSource = AnyVault


def select_sessions(
    vault: ItemSource, wanted: Sequence[str], all_sessions: bool = False
) -> list[str]:
    """The sessions named (duplicates dropped, order kept), or every one with `all_sessions`.

    Raises UnknownSession for the first that is not in the vault, before anything is read.
    """
    known = vault.session_ids()
    if all_sessions or not wanted:
        return known
    present = set(known)
    chosen = list(dict.fromkeys(wanted))
    for sid in chosen:
        if sid not in present:
            raise UnknownSession(
                f"no session {sid!r} in {vault.path}; `memvault sessions` lists them"
            )
    return chosen


# --------------------------------------------------------------------------
# The export
# --------------------------------------------------------------------------
@dataclass
class Exported:
    """What an export wrote. `path` is None when it went to a stream (stdout)."""

    path: str | None
    format: str
    sessions: list[str] = field(default_factory=list)
    items: int = 0
    expired_skipped: int = 0
    expired_included: int = 0
    unreadable: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ExportPlan:
    """An export checked and ready: every refusal happens before one is made."""

    sessions: list[str]
    path: Path | None
    format: str
    force: bool
    include_expired: bool
    # Sessions whose history chain does not verify, with what is wrong: exported only
    # with include_tampered, and marked.
    tampered: dict[str, str] = field(default_factory=dict)


def plan_export(
    vault: ItemSource,
    session_ids: Sequence[str],
    all_sessions: bool,
    path: str | os.PathLike[str] | None,
    fmt: str = "jsonl",
    force: bool = False,
    include_expired: bool = False,
    include_tampered: bool = False,
) -> ExportPlan:
    """Check everything an export needs, in the order a user fixes things.

    `path` None means a stream. Raises BadInput (exit 2) for a format, or an output
    path where a new 0600 file cannot be made (an existing file without `force`; a
    link, FIFO, device or folder, even with `force`); the key errors (exit 4);
    UnknownSession (exit 1).
    """
    if fmt not in FORMATS:
        raise BadInput(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not session_ids and not all_sessions:
        raise BadInput("name the sessions to export, or pass --all")
    if session_ids and all_sessions:
        raise BadInput("give either session ids or --all, not both")
    target = None
    if path is not None:
        target = targets.check_target(
            path,
            "export",
            targets.vault_path_of(vault),
            force_flag="--force",
            replace=force,
            recognise=recognise_export,
            kind=FORCE_REPLACES,
        )
    vault.sealer()  # a missing or revoked key fails here, before any file exists
    sessions = select_sessions(vault, session_ids, all_sessions)
    tampered = {}
    for sid in sessions:  # refused before any file exists
        kind = vault.history_verdict(sid)
        if kind is not None and not include_tampered:
            raise chainops.tampered(sid, kind, str(targets.vault_path_of(vault)))
        if kind is not None:
            tampered[sid] = kind
    return ExportPlan(sessions, target, fmt, force, include_expired, tampered)


def recognise_export(head: bytes) -> str | None:
    """None when `head` starts an export this module wrote (or is empty), else what it is."""
    text = head.decode("utf-8", "ignore")
    if not head or text.startswith(MD_TITLE) or _JSONL_START.match(text):
        return None
    return "not a memvault export"


def run_export(
    vault: ItemSource, plan: ExportPlan, stream: BinaryIO | None = None, now: int | None = None
) -> Exported:
    """Write the export to `plan.path`, or to `stream` when the plan has no path.

    A failure half-way (a key revoked meanwhile, a full disk, Ctrl-C) removes the
    new file, and with `force` leaves the old one as it was.
    """
    result = Exported(str(plan.path) if plan.path is not None else None, plan.format)
    chunks = _chunks(_render(vault, plan, result, now))
    if plan.path is None:
        if stream is None:
            raise OperationFailed("an export needs a file or a stream to write to")
        for chunk in chunks:
            stream.write(chunk)
        stream.flush()
        return result
    # Killed `--force` runs of this vault left plaintext beside their targets, wherever
    # those were (the audit trail names the folders): this run cleans up.
    folder = plan.path.absolute().parent
    try:
        known = exportdirs.recorded(vault.audit_log())
    except VaultError:
        known = set()
    beside_vault = {vault.path.absolute().parent} if isinstance(vault.path, Path) else set()
    exportdirs.clean({folder} | known | beside_vault)
    if plan.force and folder not in known and not backupmark.is_backup(vault.meta()):
        vault.record(exportdirs.EVENT, None, to=str(folder))  # before the first byte
    try:
        files.write_private(plan.path, chunks, replace=plan.force, tag=TEMP_TAG)
    except FileExistsError:  # appeared since the plan was checked
        raise BadInput(
            f"{plan.path} appeared while exporting; nothing was written; give a new file name"
        ) from None
    except OSError as exc:
        raise OperationFailed(
            f"cannot write {plan.path} ({exc.strerror}); no export was written"
        ) from None
    return result


def _chunks(pieces: Iterable[str]) -> Iterator[bytes]:
    buf: list[bytes] = []
    size = 0
    for piece in pieces:
        data = piece.encode("utf-8", "surrogatepass")
        buf.append(data)
        size += len(data)
        if size >= _CHUNK:
            yield b"".join(buf)
            buf, size = [], 0
    if buf:
        yield b"".join(buf)


def _render(
    vault: ItemSource, plan: ExportPlan, result: Exported, now: int | None
) -> Iterator[str]:
    md = plan.format == "md"
    if md:
        yield MD_TITLE + "\nDecrypted history, in plaintext: keep this file private.\n"
    for sid in plan.sessions:
        result.sessions.append(sid)
        if md:
            yield f"\n## Session {_code(escape_line(sid))}\n"
        written = 0
        kind = plan.tampered.get(sid)
        if md and kind is not None:
            yield f"\n**TAMPERED: this session's history does not verify ({kind}).**\n"
        opened = vault.opened_items(
            sid, now=now, include_expired=plan.include_expired, include_tampered=kind is not None
        )
        for position, one in enumerate(opened, 1):
            if one.state is ItemState.UNREADABLE:
                result.unreadable += 1
                continue
            expired = one.state is ItemState.EXPIRED
            if expired and not plan.include_expired:
                result.expired_skipped += 1
                continue
            result.items += 1
            result.expired_included += expired
            written += 1
            if md:
                yield _md_item(position, one.timestamp, expired, one.item)
            else:
                record = {
                    "session_id": sid,
                    "position": position,
                    "timestamp": iso_time(one.timestamp),
                    "expired": expired,
                    "item": one.item,
                }
                if kind is not None:
                    record["tampered"] = kind
                yield json.dumps(record, ensure_ascii=False) + "\n"
        if md and not written:
            yield "\n_(no items to show)_\n"


def _code(text: str) -> str:
    """`text` as a Markdown code span, whatever backticks it holds."""
    fence = "`"
    while fence in text:
        fence += "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _md_item(position: int, timestamp: int | None, expired: bool, item: Any) -> str:
    it = item_text(item)
    when = (iso_time(timestamp) or "no time") + (", expired" if expired else "")
    if it.role == "tool call":
        body = f"{_code(escape_line(it.name or ''))}({abbreviate(it.text, _ARGS_SHOWN)})"
    elif it.role == "tool output":
        body = abbreviate(it.text, _OUTPUT_SHOWN)
    else:
        body = it.text
    # A Markdown file is read with `cat` too: its text is escaped as on a terminal.
    # Quoted, so that a heading or a rule inside a message cannot break the document.
    lines = escape_text(body).splitlines() or [""]
    quoted = "\n".join(f"> {line}" if line else ">" for line in lines)
    return f"\n**{position}. {escape_line(it.role)}** · {when}\n\n{quoted}\n"
