"""`memvault sessions`, `show`, `pop` and `clear`: a vault's sessions and their items."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from vault import durations
from vault.backupmark import refuse_writes
from vault.cli.common import (
    COUNT,
    SESSION,
    check_scrub,
    common,
    confirm,
    emit,
    iso_utc,
    open_any,
    plural,
    say,
)
from vault.errors import VaultError
from vault.textsafe import escape_line, escape_text

if TYPE_CHECKING:
    from vault.engine import AnyVault


@click.command()
@common
def sessions() -> None:
    """One row per session: id, items, expired, last update.

    Unverified counts, as in `memvault status`: EXPIRED judges each item by the
    timestamp it claims; `memvault verify` authenticates every item.

    \b
    Example:
      memvault sessions
    """
    rows = [s.as_dict() for s in open_any().sessions()]
    for r in rows:
        r["updated_at"] = iso_utc(r.get("updated_at"))

    def human() -> None:
        if not rows:
            click.echo("no sessions")
            return
        click.echo(f"{'SESSION':<30} {'ITEMS':>8} {'EXPIRED*':>8}  UPDATED")
        for r in rows:
            say(
                f"{escape_line(r['session_id']):<30} {r['items']:>8} {r['expired_unverified']:>8}  "
                f"{r['updated_at'] or '-'}"
            )
        click.echo("* by timestamp, unverified: `memvault verify` authenticates every item")

    emit(rows, human)


def _item_text(item: Any) -> str:
    if isinstance(item, dict):
        role = item.get("role") or item.get("type") or "item"
        content = item.get("content")
        if isinstance(content, str):
            return f"{role}: {content}"
        if isinstance(content, list):
            parts = [c.get("text", "") for c in content if isinstance(c, dict)]
            if any(parts):
                return f"{role}: {' '.join(p for p in parts if p)}"
        return f"{role}: {json.dumps(item, ensure_ascii=False)}"
    return json.dumps(item, ensure_ascii=False)


def _size(vault: AnyVault, session_id: str) -> int:
    """How many items SESSION stores (0 if none or unknown), counted in SQL, unverified."""
    return next((s.items for s in vault.sessions() if s.session_id == session_id), 0)


@click.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option(
    "--limit",
    type=COUNT,
    metavar="N",
    help="Only the newest N items.",
)
@click.option("--include-expired", is_flag=True, help="Also show items past the TTL.")
@click.option(
    "--include-tampered",
    is_flag=True,
    help="Show a session whose history does not verify, marked as tampered.",
)
@common
def show(session_id: str, limit: int | None, include_expired: bool, include_tampered: bool) -> None:
    """Print the decrypted items of SESSION, oldest first.

    Each item is numbered #position, as in `export` and `search`: its place
    among every stored item of the session (1 = oldest). Items past the TTL
    are left out unless --include-expired, which marks them (expired). A
    session whose history chain does not verify (reordered, replayed, cut) is
    refused, exit 1, unless --include-tampered, which marks it.

    \b
    Example:
      memvault show carnet-local --limit 10
    """
    from vault.crypto import ItemState

    vault = open_any()
    first = 1
    if limit is not None:
        # Only the newest rows are read: the session's size (counted just before, in
        # SQL) numbers them as export and search do.
        size = _size(vault, session_id)
    tampered = vault.history_verdict(session_id) if include_tampered else None
    opened = list(
        vault.opened_items(
            session_id, limit, include_expired=include_expired, include_tampered=include_tampered
        )
    )
    if limit is not None:
        first = max(size - len(opened), 0) + 1
    shown: list[tuple[int, bool, Any]] = []
    expired = unreadable = 0
    for position, one in enumerate(opened, first):
        if one.state is ItemState.EXPIRED:
            expired += 1
            if include_expired:
                shown.append((position, True, one.item))
        elif one.state is ItemState.READABLE:
            shown.append((position, False, one.item))
        else:
            unreadable += 1
    items = [item for _, _, item in shown]

    def human() -> None:
        if tampered is not None:
            click.echo(
                f"TAMPERED: the history of session {escape_line(session_id)} does not verify "
                f"({tampered})"
            )
        if not opened:
            say(f"session {session_id} is empty")
        for position, old, it in shown:
            click.echo(f"#{position}{' (expired)' if old else ''} {escape_text(_item_text(it))}")
        if expired and not include_expired:  # else an expired session would print nothing
            click.echo(
                f"{plural(expired, 'expired item')} hidden by the TTL "
                f"({durations.format_duration(vault.ttl)}); `memvault purge` deletes them, "
                "--include-expired shows them"
            )

    data = {
        "session_id": session_id,
        "items": items,
        "positions": [position for position, _, _ in shown],
        "expired": expired,
        "unreadable": unreadable,
    }
    if tampered is not None:
        data["tampered"] = tampered
    emit(data, human)
    if unreadable:
        raise VaultError(
            f"{plural(unreadable, 'item')} of session {session_id!r} failed authentication "
            "(tampered, corrupt or sealed with another key) and "
            f"{'was' if unreadable == 1 else 'were'} not shown; nothing was changed"
        )


@click.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option(
    "-n",
    "count",
    type=COUNT,
    metavar="N",
    default=1,
    show_default=True,
    help="How many of the newest items to remove.",
)
@click.option("--yes", is_flag=True, help="Do not ask before emptying the session.")
@common
def pop(session_id: str, count: int, yes: bool) -> None:
    """Remove the newest N items of SESSION (to undo a turn, pop 2).

    Asks first (unless --yes) when N reaches the session's size, since the
    whole session would go.

    \b
    Example:
      memvault pop carnet-local -n 2
    """
    vault = open_any()
    if not yes:
        vault.sealer()  # fail on the key before asking anything (counting needs none)
        size = _size(vault, session_id)
        if 0 < size <= count:  # an unknown session fails in pop, with its own message
            confirm(
                f"Remove all {plural(size, 'item')} of session {session_id!r}, emptying it?",
                yes,
            )
    result = vault.pop(session_id, count)
    popped = result.items
    data: dict[str, Any] = {"session_id": session_id, "popped": popped, "requested": count}
    note = result.note  # PostgreSQL: what becomes of the deleted rows
    if note:
        data["scrub"] = note
    emit(
        data,
        lambda: click.echo(
            f"removed {plural(len(popped), 'item')} from {escape_line(session_id)}"
            + (f" (asked for {count}: it had no more)" if len(popped) < count else "")
            + (f"\nscrub: {note}" if note else "")
        ),
    )
    check_scrub(result.scrubbed)


@click.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--include-unreadable",
    is_flag=True,
    help="Also delete items that fail authentication (refused by default).",
)
@common
def clear(session_id: str, yes: bool, include_unreadable: bool) -> None:
    """Empty SESSION; other sessions in the file are untouched.

    Refuses, deleting nothing, if an item of SESSION fails authentication
    (tampered, corrupt or under another key), unless --include-unreadable.

    \b
    Example:
      memvault clear carnet-local --yes
    """
    vault = open_any()
    refuse_writes(vault, "`memvault clear`")  # before anything is asked
    vault.sealer()  # fail on the key before asking anything
    confirm(f"Delete every item of session {session_id!r}?", yes)
    result = vault.clear(session_id, include_unreadable=include_unreadable)
    n, bad = result.deleted, result.unreadable_deleted
    data: dict[str, Any] = {
        "session_id": session_id,
        "deleted": n,
        "unreadable_deleted": bad,
        "scrubbed": result.scrubbed,
    }
    note = result.note  # PostgreSQL: what becomes of the deleted rows
    if note:
        data["scrub"] = note
    emit(
        data,
        lambda: click.echo(
            f"cleared {escape_line(session_id)}: {n} item(s) deleted"
            + (f", {bad} of them unreadable" if bad else "")
            + (f"\nscrub: {note}" if note else "")
        ),
    )
    check_scrub(result.scrubbed)


COMMANDS = (sessions, show, pop, clear)
